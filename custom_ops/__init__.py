"""specport.custom_ops"""

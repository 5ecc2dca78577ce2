"""specport.passes"""

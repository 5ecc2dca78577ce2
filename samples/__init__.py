"""specport.samples"""

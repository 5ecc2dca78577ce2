"""specport.runtime"""

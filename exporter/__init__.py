"""specport.exporter"""

"""specport.runtime.speculative"""

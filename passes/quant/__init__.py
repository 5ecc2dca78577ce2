"""specport.passes.quant"""

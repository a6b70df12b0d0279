"""zaya.resilience"""

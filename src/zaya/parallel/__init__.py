"""zaya.parallel"""

"""zaya.infer"""

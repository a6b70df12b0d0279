"""zaya.optim"""

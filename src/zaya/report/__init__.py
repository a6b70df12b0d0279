"""zaya.report"""

"""zaya.train"""

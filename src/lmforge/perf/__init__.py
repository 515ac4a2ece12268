"""lmforge.perf"""

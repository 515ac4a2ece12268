"""lmforge.serve"""

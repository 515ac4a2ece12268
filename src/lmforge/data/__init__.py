"""lmforge.data"""

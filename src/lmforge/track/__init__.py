"""lmforge.track"""

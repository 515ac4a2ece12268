"""lmforge.engine"""

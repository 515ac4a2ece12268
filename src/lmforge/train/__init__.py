"""lmforge.train"""

"""expose"""

"""fedemu.worker"""

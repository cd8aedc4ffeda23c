"""fedemu.launch"""

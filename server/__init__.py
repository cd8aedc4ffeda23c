"""fedemu.server"""

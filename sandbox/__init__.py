"""Sandbox fleet for tests and the demo: simulated host trees and stand-ins for what needs a GPU."""

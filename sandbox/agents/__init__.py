"""Agents run by the `python` harness preset (see launch.py), and a scripted example agent."""

"""Whole-stack tools: launchers and experiments that run every part of rolltap together."""

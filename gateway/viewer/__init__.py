"""The trace viewer at /ui: static HTML, CSS and JS from this package (no build step, nothing
fetched from the network) over a few JSON routes that read the store. Admin key only."""

from gateway.viewer.routes import install

__all__ = ["install"]

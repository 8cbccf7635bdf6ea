"""The Dagster resources of the code location, built from the settings."""

from __future__ import annotations

from .core.layout import Layout
from .launchers import Launcher, launcher_from_settings
from .settings import Settings


def resources(settings: Settings) -> dict:
    """`launcher`: where the GPU jobs run (this machine by default, or Kubernetes)."""
    return {"launcher": launcher_from_settings(settings.launcher)}


def layout(settings: Settings) -> Layout:
    return Layout(settings.root)


__all__ = ["Launcher", "layout", "resources"]

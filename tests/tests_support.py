"""Helpers shared by test modules (imported by name: pytest puts tests/ on sys.path)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

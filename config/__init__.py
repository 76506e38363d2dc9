"""Shipped configuration: the default models.yaml and a commented example (package data)."""

"""Presentation: rich tables, JSON/CSV/Markdown files and plots. Compute modules never print."""

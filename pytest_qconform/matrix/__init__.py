"""The compatibility matrix merged from run reports: model, Markdown, summary, heatmap, figures,
and the CLI ``python -m pytest_qconform.matrix.cli.cli`` (``nox -s matrix``).
"""

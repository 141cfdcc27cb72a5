"""Reporting for people: tables (``rich``) and plots (``matplotlib``, optional)."""

from remat.report.plots import FrontierPoint, plot_frontier, plot_timeline
from remat.report.tables import (
    ComparisonRow,
    comparison_table,
    markdown_table,
    plan_table,
    profile_table,
    render_text,
)

__all__ = [
    "ComparisonRow",
    "FrontierPoint",
    "comparison_table",
    "markdown_table",
    "plan_table",
    "plot_frontier",
    "plot_timeline",
    "profile_table",
    "render_text",
]

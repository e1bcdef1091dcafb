"""The embedded end-to-end demo: orchestration, live terminal view, the HTML report."""

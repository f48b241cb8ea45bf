"""Long-context evaluation: benchmark generators and loaders, scorers, generation, reports."""

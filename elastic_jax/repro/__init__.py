"""The small-scale reproduction: a synthetic task mixture, a small backbone pretrained on it
with full attention (shipped in backbone/), and the recipe that trains and evaluates routers."""

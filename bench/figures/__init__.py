"""Scripts that reproduce the figures docs/ cite, each writing the bench/results/ file named beside
the figure; the tools users run are one level up, in bench/."""

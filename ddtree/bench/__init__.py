"""`ddtree bench`: rows of methods timed on the same prompts (`rows`), and the tree build alone (`tree_build`)."""

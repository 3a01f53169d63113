"""Distribution of lingvo_ext models: processes, clusters, gradient sync."""

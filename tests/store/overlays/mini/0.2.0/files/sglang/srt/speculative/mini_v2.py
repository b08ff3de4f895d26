"""mini overlay 0.2.0: a module only this version adds."""

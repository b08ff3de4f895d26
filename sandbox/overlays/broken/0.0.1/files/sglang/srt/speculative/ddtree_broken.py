"""A module that does not compile: the sandbox's broken overlay."""

def build_tree(draft_logits, budget)
    return draft_logits[:budget]

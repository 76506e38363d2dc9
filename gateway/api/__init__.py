"""One module per public API family; each translates to and from the one internal request."""

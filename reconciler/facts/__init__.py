"""What exists, as data: the observed types, pure parsers of command
output, the claim and image-meta formats. No I/O."""

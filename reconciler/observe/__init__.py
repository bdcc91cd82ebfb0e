"""One observation pass: images, mappings, devices, filesystems, mounts,
each read with a deadline."""

"""What a checkpoint holds and how it is written and read: loader state, safe files, manifests and sealing, versions, verification and merging on resume, refusals, DCP."""

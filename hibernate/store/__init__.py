"""Snapshots on disk: format, atomic publish, and a writer and reader at disk speed.

The store knows regions of memory, never torch or CUDA. Import each name from its module:

    regions      what the store streams: a region of memory, host or device (Region)
    manifest     the format's numbers, the manifest's types and its canonical bytes (docs/format.md)
    parse        what a reader accepts of a manifest; the same rules a writer applies to its regions
    owner        whose a spill root is: a process named beyond its pid
    layout       a spill root: its snapshots, the lock, atomic publish (SpillRoot)
    maintenance  ``hibernate gc``: reclaim the snapshots nobody needs
    export       ``hibernate export``: a snapshot's tensors as safetensors files, every chunk verified
    directio     direct I/O with page-aligned staging buffers, and its buffered fallback
    hugepages    whether a wake asks for transparent huge pages
    bulk         checksum and copy many chunks in one call (the optional compiled helper)
    pipeline     a transfer's worker threads, stopped together, and the callbacks it takes
    options      how a snapshot is written (WriteOptions)
    arena        staging arenas: chunks packed back to back, one write request each
    stream       a spill's chunks through stagers, arenas and writers into data files
    reuse        reusing the previous snapshot: link its unchanged files, index and trim them
    reusecheck   read back every reused chunk before a re-sleep releases anything
    writer       write_snapshot: a new snapshot, all or nothing
    readplan     how a wake reads: requests in file order, the workers' groups, each chunk's destination
    reader       SnapshotReader: verify and read a snapshot back into regions; verify_snapshot
"""

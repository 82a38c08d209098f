"""Exact tile counting: how many tiles (and score entries) a kernel visits, without its block map.

The tiled and sparse kernels walk a block map of ``ceil(Lq / bq) x ceil(Lk / bk)`` tiles; at a
million tokens and beyond that map cannot be built, yet the cost formulas need its count exactly.
The algebra, in four lines:

1. a mask is read as a tree: leaves are patterns of the offset ``q - k`` (causal, windows, strides)
   or patterns constant over runs of rows (global tokens, documents, padding, block layouts, ``fixed``),
   joined by ``&``, ``|``, ``~`` that combine tile states as block maps do (min, max, FULL <-> EMPTY);
2. over a run of block rows each leaf's visited key tiles are intervals whose ends are affine in
   the row, so a row's count is a polynomial summed over the run in closed form;
3. where strides break the intervals, tiles are counted along diagonals with floor sums;
4. what no closed form reads (BigBird's random blocks, a user function) is counted on the block map
   a few rows at a time, and refused with an estimate when that would take more than about a second.

Modules, from the entry point down:

=====================  ==========================================================================
``visited``            the entry point: tiles and entries visited for a shape; tries the counters
``mask_tree``          a mask read as a tree of nodes, one per (batch, head) slice
``offset_nodes``       leaves that depend on the offset ``q - k``
``run_nodes``          leaves constant over runs of rows and key tiles
``logic_nodes``        ``&``, ``|``, ``~`` and the union of slices
``grid``               the shared vocabulary: tile grid, runs of rows, affine ends, polynomials
``interval_count``     counts trees whose key tiles per row are a few intervals (step 2)
``diagonal_count``     counts offset trees of any stride along diagonals (step 3)
``floor_sums``         sums of ``floor((a k + b) / m)`` in ``O(log)`` steps, for step 3
``document_count``     counts packed documents (with a band), vectorised over documents
``layout_count``       counts a block layout (with causal) from its cells
``fixed_count``        the Sparse Transformer's ``fixed`` pattern, and its counter for any stride
``streamed_count``     counts the block map a few rows at a time (step 4)
=====================  ==========================================================================

Every count is checked against the block map tile for tile (``tests/test_costs_tiles.py``,
``tests/test_costs_all_patterns.py``).
"""

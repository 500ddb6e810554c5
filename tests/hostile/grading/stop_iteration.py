# Attacks the grader, not the host: solve() raises StopIteration, which a test's map() or filter()
# takes for the end of its input, so `all(map(solve, cases))` and a loop over `map(solve, ...)`
# pass without a single call answering. It worked under the old judge (plain Python semantics in
# the program's interpreter); the tests' sandbox fails a call that raises StopIteration.
# tests: ["assert all(map(solve, [1, 2, 3]))", "for ok in map(solve, [4, 5]):\n    assert ok"]
def solve(x):
    raise StopIteration

# Attacks CPU time: an infinite busy loop in the program itself. It never returns.
def solve():
    n = 0
    while True:
        n += 1

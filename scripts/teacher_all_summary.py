#!/usr/bin/env python3
"""The tables of docs/RESULTS.md "A teacher that sees what it labels" from a folder of
`cdcca adapt-eval --teacher_all_arms` reports named SHIFTSEVERITY_sSEED.json
(scripts/teacher_all_matrix.sh). Usage: scripts/teacher_all_summary.py DIR"""
import sys

from adapt_eval_reports import load
from adapt_eval_reports import mean_se as ms
from adapt_eval_reports import row as g

meta = load(sys.argv[1])
arms = ['all', 'uts-vis-50', 'uts-vis-50+teacher-all', 'random-50', 'random-50+teacher-all']
learners = ['pl', 'akd+l_kl=0.5']
print('| shift | seed | source | teacher | teacher on uplink: all / UTS-vis 50 % / random 50 % | ' + ' | '.join(a for a in arms) + ' |')
print('|---|---|---|---|---|' + '---|' * len(arms))
for (shift, seed), r in sorted(meta.items()):
    tu = [g(r, a, 'pl')['teacher_uplink_accuracy'] for a in ['all', 'uts-vis-50', 'random-50']]
    cells = ['%+.1f / %+.1f' % tuple(g(r, a, l)['gain'] for l in learners) for a in arms]
    print('| %s | %d | %.1f | %.1f | %.1f / %.1f / %.1f | %s |' % (shift, seed, r['source_accuracy'], r['teacher_accuracy'], *tu, ' | '.join(cells)))
print()
shifts = sorted(set(s for s, _ in meta))
comparisons = [
    ('all - uts-vis-50', 'all', 'uts-vis-50'),
    ('uts-vis-50+teacher-all - uts-vis-50', 'uts-vis-50+teacher-all', 'uts-vis-50'),
    ('random-50+teacher-all - random-50', 'random-50+teacher-all', 'random-50'),
    ('uts-vis-50 - random-50', 'uts-vis-50', 'random-50'),
]
print('| shift | seeds | ' + ' | '.join(c[0] + ' (PL / AKD+KL)' for c in comparisons) + ' | all: gain PL / AKD+KL | share of the gap (AKD+KL, all) |')
print('|---|---|' + '---|' * (len(comparisons) + 2))
for s in shifts:
    rs = [meta[k] for k in sorted(meta) if k[0] == s]
    cells = []
    for _, a, b in comparisons:
        cells.append(' / '.join(ms([g(r, a, l)['gain'] - g(r, b, l)['gain'] for r in rs]) for l in learners))
    gains = ' / '.join(ms([g(r, 'all', l)['gain'] for r in rs]) for l in learners)
    share = ms([100 * g(r, 'all', 'akd+l_kl=0.5')['gain'] / (r['teacher_accuracy'] - r['source_accuracy']) for r in rs])
    print('| %s | %s | %s | %s | %s |' % (s, ','.join(str(k[1]) for k in sorted(meta) if k[0] == s), ' | '.join(cells), gains, share))

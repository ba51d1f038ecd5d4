#!/usr/bin/env python3
"""The tables of docs/RESULTS.md "The feature term alone" from a folder of `cdcca adapt-eval`
reports named SHIFTSEVERITY_sSEED.json (scripts/feature_term_matrix.sh): per run the gain of
each learner over the source student, then per shift and pooled over every run the paired
differences of AKD (CD-CCA's learner) against PL, PKD and CWD, mean (SE across runs).
Usage: scripts/feature_term_summary.py DIR"""
import collections
import sys

from adapt_eval_reports import load, mean_and_se, row
from adapt_eval_reports import mean_se as ms

NAMES = ['PL', 'PKD', 'CWD', 'AKD']
runs = load(sys.argv[1])
# The learners' specs as the reports name them (pl..., pkd..., cwd..., akd..., any overrides).
specs = [x['learner'] for x in next(iter(runs.values()))['rows'] if x['arm'] == 'all']
LEARNERS = [next(s for s in specs if s.startswith(n.lower())) for n in NAMES]
print('Learners: ' + ', '.join(LEARNERS) + '\n')


def gain(r, learner):
    return row(r, 'all', learner)['gain']


print('| shift | seed | source | teacher | gain: ' + ' / '.join(NAMES) + ' |')
print('|---|---|---|---|---|')
for (shift, seed), r in sorted(runs.items()):
    print('| %s | %d | %.1f | %.1f | %s |' % (shift, seed, r['source_accuracy'], r['teacher_accuracy'],
                                            ' / '.join('%+.1f' % gain(r, l) for l in LEARNERS)))
print()
print('| shift | runs | teacher\'s lead | gain: ' + ' / '.join(NAMES) +
      ' | AKD minus PL | AKD minus PKD | AKD minus CWD | AKD, share of the lead where it is >= 5 |')
print('|---|---|---|---|---|---|---|---|')
groups = collections.OrderedDict()
for k in sorted(runs):
    groups.setdefault(k[0], []).append(runs[k])
groups['all runs'] = [runs[k] for k in sorted(runs)]
for name, rs in groups.items():
    lead = [r['teacher_accuracy'] - r['source_accuracy'] for r in rs]
    gains = ' / '.join('%+.2f' % (sum(gain(r, l) for r in rs) / len(rs)) for l in LEARNERS)
    diffs = [ms([gain(r, LEARNERS[3]) - gain(r, l) for r in rs]) for l in LEARNERS[:3]]
    # The share of the lead only where the teacher leads by 5 or more (the half-the-lead measure).
    led = [100 * gain(r, LEARNERS[3]) / d for r, d in zip(rs, lead) if d >= 5]
    if led:
        m, se = mean_and_se(led)
        se = '' if se is None else ' (%.1f)' % se
        share = '%.0f %%%s, %d run%s' % (m, se, len(led), '' if len(led) == 1 else 's')
    else:
        share = '- (lead < 5)'
    print('| %s | %d | %.2f | %s | %s | %s |' % (name, len(rs), sum(lead) / len(lead), gains,
                                                 ' | '.join(diffs), share))
print()
print('The feature terms during the jobs, mean over every run: first step -> mean of the last 10 steps (their'
      ' weighted share of the first step\'s total loss).')
print()
print('| learner | L_query | L_repr | CE | KL |')
print('|---|---|---|---|---|')
for name, learner in zip(NAMES, LEARNERS):
    rows = [x for r in runs.values() for x in r['rows'] if x['arm'] == 'all' and x['learner'] == learner]
    cells = []
    for term in ['query', 'repr', 'ce', 'kl']:
        if term not in rows[0]['terms']:
            cells.append('-')
            continue
        first = sum(x['terms'][term]['first'] for x in rows) / len(rows)
        last = sum(x['terms'][term]['last'] for x in rows) / len(rows)
        total = sum(x['terms']['total']['first'] for x in rows) / len(rows)
        weight = {'query': 'l_query', 'repr': 'l_repr', 'ce': 'l_ce', 'kl': 'l_kl'}[term]
        w = dict(kv.split('=') for kv in learner.split('+')[1:]).get(weight)
        w = float(w) if w is not None else {'l_query': 0.1, 'l_repr': 0.1, 'l_ce': 1.0}[weight]
        cells.append('%.3f -> %.3f (%.0f %%)' % (first, last, 100 * w * first / total))
    print('| %s | %s |' % (name, ' | '.join(cells)))

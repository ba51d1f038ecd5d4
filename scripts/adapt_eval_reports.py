"""What the summaries of `cdcca adapt-eval` matrices share (scripts/teacher_all_summary.py,
scripts/feature_term_summary.py): the reports of a folder, a row of one, a mean with its SE."""
import glob
import json
import math
import sys


def load(folder):
    """The reports named SHIFTSEVERITY_sSEED.json in `folder`, by (shift, seed); exits when
    there are none."""
    runs = {}
    for f in sorted(glob.glob(folder + '/*_s*.json')):
        shift, seed = f.split('/')[-1][:-5].rsplit('_s', 1)
        with open(f) as fh:
            runs[(shift, int(seed))] = json.load(fh)
    if not runs:
        sys.exit('no reports in ' + folder)
    return runs


def row(report, arm, learner):
    """The report's row for `arm` and `learner`."""
    for x in report['rows']:
        if x['arm'] == arm and x['learner'] == learner:
            return x
    raise KeyError('%s has no row for arm "%s", learner %s' % (report.get('shift', '?'), arm, learner))


def mean_and_se(values):
    """The mean and its standard error across `values` (None for a single value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    sd = math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))
    return m, sd / math.sqrt(len(values))


def mean_se(values):
    """'+m (se)', or '+m' for a single value."""
    m, se = mean_and_se(values)
    return '%+.2f' % m if se is None else '%+.2f (%.2f)' % (m, se)

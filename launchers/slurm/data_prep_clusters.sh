#!/usr/bin/env bash
# UniRef50 clusters (data_prep uniref --clusters) across machines, the member FASTA read once between the jobs:
# three dependent SLURM submissions. From the repository root:
#
#   bash launchers/slurm/data_prep_clusters.sh N uniref --input members.fasta --clusters map.tsv --output DIR [...]
#
# 1. scan: an array of N tasks, task I parsing its share of the member FASTA (a byte range of plain FASTA; every
#    chunk c with c % N == I of gzip, which each task decompresses whole) into DIR/.scan-of-NNNN (data_prep/scan.py);
# 2. build (afterok: every scan task): task I joins the clusters of TSV rows r % N == I against every part and
#    writes job I's shards;
# 3. merge (afterok: every build task): DIR/manifest.json, and the scan parts removed.
# Each stage is launchers/slurm/data_prep.sbatch (N and I from the array); a failed task is rerun alone as there.
# SBATCH overrides the submit command (a test passes a stand-in). Prints the three job ids.
set -euo pipefail

die() {
  echo "data_prep_clusters.sh: error: $*" >&2
  exit 2
}

(($# >= 2)) || die "usage: $0 N uniref --input FASTA --clusters TSV --output DIR [data_prep options]"
[[ $1 =~ ^[1-9][0-9]*$ ]] || die "N=$1 is not a positive integer (the number of jobs of each stage)"
n=$1
shift
[[ $1 == uniref ]] || die "the stages are those of data_prep uniref --clusters, not of $1"
output="" clusters=""
args=("$@")
for ((k = 0; k < ${#args[@]}; k++)); do
  case ${args[k]} in
    --output) output=${args[k + 1]:-} ;;
    --output=*) output=${args[k]#--output=} ;;
    --clusters | --clusters=*) clusters=yes ;;
    --stage | --stage=*) die "${args[k]}: the chain sets --stage itself (scan, then build)" ;;
  esac
done
[[ -n $clusters ]] || die "no --clusters TSV: without it a data_prep job has one stage (launchers/slurm/data_prep.sbatch)"
[[ -n $output ]] || die "no --output DIR"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
submit=${SBATCH:-sbatch}
scan=$($submit --parsable --array=0-$((n - 1)) "$here/data_prep.sbatch" "$@" --stage scan)
build=$($submit --parsable --array=0-$((n - 1)) --dependency=afterok:${scan%%;*} "$here/data_prep.sbatch" "$@" \
  --stage build)
merge=$($submit --parsable --dependency=afterok:${build%%;*} "$here/data_prep_merge.sbatch" --output "$output")
echo "data_prep_clusters.sh: scan array ${scan%%;*}, build array ${build%%;*} (afterok), merge ${merge%%;*} (afterok)"

cd /work/main
for round in 1 2 3; do for mode in t1 auto t2; do
  case $mode in t1) export NINFER_CPU_THREADS=1;; t2) export NINFER_CPU_THREADS=2;; auto) unset NINFER_CPU_THREADS;; esac
  sleep 5
  timeout 300 .venv/bin/python bench/http_decode.py --launch configs/tiny.yaml --prompt-len 128 1000 --max-tokens 256 2>/dev/null \
    | python3 -c "
import sys,json
for l in sys.stdin:
    d=json.loads(l); d['mode']='$mode'; d['round']=$round; print(json.dumps(d))"
done; done

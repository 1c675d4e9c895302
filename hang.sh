#!/bin/bash
cd /tmp/h33
python3 load.py l7a.json 25 c3 40051:40:2 40052:20:1 > l7a.out 2>&1 &
python3 load.py l7b.json 25 c5 40051:40:2 40052:20:1 > l7b.out 2>&1 &
sleep 5
kill -STOP $(cat r40201.pid); echo "stopped $(date +%T.%N)"
for i in $(seq 1 12); do sleep 0.5; echo "$(date +%T.%N) $(curl -s 127.0.0.1:40061/metrics | grep -E '^tollgate_cluster_redis_(up|partly)' | tr '\n' ' ')"; done
sleep 4; kill -CONT $(cat r40201.pid); echo "cont $(date +%T.%N)"
wait; cat l7a.out l7b.out

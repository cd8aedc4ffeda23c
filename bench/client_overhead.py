"""CPU time of one client task of one example (the cross-device case of bench/scale.py):
load the round's weights, one SGD step, the weights out. Prints the min and median over 7
repeats of 1,000 tasks on one thread.

    python bench/client_overhead.py LABEL
"""
import time, numpy as np, torch, sys
torch.set_num_threads(1)
from fedemu.worker.ml import models, training
from fedemu.worker.ml.datasets import get
ds=get("mnist")
spec=models.ModelSpec("2nn", ds)
m=spec.build(seed=0)
w=models.get_flat(m)
x=np.random.randint(0,255,(1,28,28),dtype=np.uint8); y=np.array([3],dtype=np.uint8)
def one():
    models.set_flat(m,w)
    return training.client_update(m,x,y,epochs=1,batch_size=10,lr=0.1,generator=torch.Generator().manual_seed(1),dataset=ds)
for _ in range(200): one()
best=[]
for rep in range(7):
    t=time.thread_time(); N=1000
    for _ in range(N): one()
    best.append((time.thread_time()-t)/N*1e3)
print(sys.argv[1], "CPU ms per client: min %.3f median %.3f" % (min(best), sorted(best)[3]))

"""CPU emulation of the INT2 decode V accumulation at the 131072-token geometry (one sequence, one KV head, bench data).

Modes: chain = MMA accumulates onto the chunk accumulator (k16 blocks, fp32 round-toward-zero, the tensor-core model),
tile = fresh per-tile MMA + fp32 round-to-nearest add (IMPL5_TILE_ACC), vfold = fresh dot on 1024 + code, offset
subtracted in fp32. Prints the relative RMSE of o vs float64 per split count.
    python bench/emu_tc_accumulation.py SEED SPLITS MODES   e.g.  1 5,9,17,33 chain,tile,vfold
"""
import torch, math, sys
L=130752; D=128; G=4
def rz(x):  # float64 -> fp32 rounded toward zero (tensor-core accumulate model)
    y=x.float()
    over=y.double().abs()>x.abs()
    y=torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y)
    return y.double()
def mma(acc, pv, c):  # acc [G,D] + pv[G,64] @ c[64,D], K=16 blocks, RZ after each
    for k in range(0, pv.shape[1], 16):
        acc=rz(acc + pv[:,k:k+16]@c[k:k+16])
    return acc
def run(seed, splits, mode):
    g=torch.Generator().manual_seed(seed)
    q=torch.randn(G,D,generator=g).to(torch.bfloat16).double()
    kc=torch.randint(0,4,(L,D),generator=g).double()
    vc=torch.randint(0,4,(L,D),generator=g).double()
    ks=(torch.rand(L,generator=g)*0.5+0.1).half().double()
    vs=(torch.rand(L,generator=g)*0.5+0.1).half().double()
    kz=(torch.rand(L,generator=g)*3).half().double()
    vz=(torch.rand(L,generator=g)*3).half().double()
    sc=1/math.sqrt(D)*1.4426950408889634
    s=(q@kc.T - kz[None]*q.sum(1)[:,None])*ks[None]*sc
    v=(vc-vz[:,None])*vs[:,None]
    w=torch.exp2(s-s.max(1,keepdim=True).values)
    o_ex=(w@v)/w.sum(1,keepdim=True)
    out={}
    for S in splits:
      for md in mode:
        chunk=-(-(-(-L//S))//64)*64
        os_,ls_=[],[]
        for sp in range(S):
            a,b=sp*chunk,min(sp*chunk+chunk,L)
            if a>=b: continue
            m=torch.full((G,),-math.inf,dtype=torch.float64); l=torch.zeros(G,dtype=torch.float64)
            acc=torch.zeros(G,D,dtype=torch.float64); az=torch.zeros(G,dtype=torch.float64)
            for t0 in range(a,b,64):
                t1=min(t0+64,b)
                st=s[:,t0:t1].float().double()
                mn=torch.maximum(m,st.max(1).values)
                al=torch.exp2(m-mn).float().double(); p=torch.exp2(st-mn[:,None]).float()
                l=l*al+p.double().sum(1)
                pv=(p*vs[t0:t1].float()[None]).half().double()
                az=(az*al+(pv*vz[t0:t1][None]).sum(1)).float().double()
                if md=='chain':  acc=mma((acc*al[:,None]).float().double(), pv, vc[t0:t1])
                elif md=='tile': acc=(acc*al[:,None]+mma(torch.zeros_like(acc), pv, vc[t0:t1])).float().double()
                elif md=='vfold':
                    d=mma(torch.zeros_like(acc), pv, vc[t0:t1]+1024)
                    acc=(acc*al[:,None]+(d-(pv.sum(1)*1024).float().double()[:,None]).float().double()).float().double()
                m=mn
            os_.append((acc-az[:,None])/l[:,None]); ls_.append(m+torch.log2(l))
        O=torch.stack(os_,1); Ls=torch.stack(ls_,1)
        ww=torch.exp2(Ls-Ls.max(1,keepdim=True).values)
        o=(ww[:,:,None]*O).sum(1)/ww.sum(1,keepdim=True)
        out[(S,md)]=o
        err=((o-o_ex).pow(2).mean().sqrt()/o_ex.pow(2).mean().sqrt()).item()
        print(f'seed {seed} splits {S} ({chunk} tok) {md}: rel_rmse vs exact {err:.2e}', flush=True)
    return out, o_ex
if __name__=='__main__':
    out,o_ex=run(int(sys.argv[1]), [int(x) for x in sys.argv[2].split(',')], sys.argv[3].split(','))
    keys=list(out)
    r=out[keys[0]]
    for k in keys[1:]:
        print(k,'vs',keys[0],'%.2e'%((out[k]-r).pow(2).mean().sqrt()/r.pow(2).mean().sqrt()).item())

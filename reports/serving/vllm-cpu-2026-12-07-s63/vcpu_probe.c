/* The host's two vCPUs: FMA throughput on one and on both, and a cache line's round trip
 * between them (session 63: ~57 ns when they share a core complex, ~333 ns when not, the
 * placement changing every few tens of seconds).  gcc -O2 -mavx512f -pthread vcpu_probe.c */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdatomic.h>
#include <time.h>
#include <immintrin.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static volatile int go; static double result[2];
static void *fma_loop(void *arg){int c=(int)(long)arg;pin(c);while(!go);
 __m512 a[8];for(int i=0;i<8;i++)a[i]=_mm512_set1_ps(1.0f+i);__m512 b=_mm512_set1_ps(0.999f),d=_mm512_set1_ps(0.001f);
 double t0=now();long n=0;while(now()-t0<0.15){for(int r=0;r<1000;r++)for(int i=0;i<8;i++)a[i]=_mm512_fmadd_ps(a[i],b,d);n+=8000;}
 float s=0;for(int i=0;i<8;i++)s+=_mm512_reduce_add_ps(a[i]);result[c]=n*32.0/(now()-t0)/1e9+s*0;return 0;}
static atomic_int ball;
static void *pong(void *arg){pin(1);for(int i=0;i<200000;i++){while(atomic_load_explicit(&ball,memory_order_acquire)!=1);atomic_store_explicit(&ball,0,memory_order_release);}return 0;}
int main(void){pthread_t t[2];
 go=0;pthread_create(&t[0],0,fma_loop,(void*)0L);go=1;pthread_join(t[0],0);double one=result[0];
 go=0;for(long c=0;c<2;c++)pthread_create(&t[c],0,fma_loop,(void*)c);go=1;for(int c=0;c<2;c++)pthread_join(t[c],0);
 double two=result[0]+result[1];
 pthread_create(&t[1],0,pong,0);pin(0);double t0=now();for(int i=0;i<200000;i++){atomic_store_explicit(&ball,1,memory_order_release);while(atomic_load_explicit(&ball,memory_order_acquire)!=0);}
 double rt=(now()-t0)/200000*1e9;pthread_join(t[1],0);
 printf("fma 1t %.1f 2t %.1f GFLOP/s (x%.2f) pingpong %.0f ns\n",one,two,two/one,rt);return 0;}
